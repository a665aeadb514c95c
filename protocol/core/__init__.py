"""The dialect-neutral core every API dialect shares: the error type (`errors`), the request
body's field readers (`fields`), the bounds every dialect enforces (`limits`) and one
request's completion stream (`stream`). No I/O; imports no dialect."""
