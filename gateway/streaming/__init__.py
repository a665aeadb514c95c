"""One request on its way to its client: the one endpoint, the relay, the buffer, the transports."""
