"""The stores' shared bounds, on a clock the test drives: the count and byte limits (oldest
first, the newest spared), the TTL, the byte count through replace, resize and delete, and a
backing every change is written through to (gateway.stores.sqlite's, here a dict)."""

from __future__ import annotations

import attrs

from gateway.stores.bounded import BoundedStore, Row


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(
    count: int = 10, nbytes: int = 1000, ttl: float = 60, clock: Clock | None = None
) -> BoundedStore[str, str]:
    return BoundedStore(count, nbytes, ttl, clock or Clock())


def test_the_oldest_goes_first_past_the_count() -> None:
    store = make(count=3)
    for key in "abcd":
        assert store.put(key, key.upper(), 10)
    assert store.values() == ["B", "C", "D"]
    assert store.get("a") is None
    assert (len(store), store.nbytes) == (3, 30)


def test_the_oldest_go_first_past_the_bytes_and_the_newest_stays() -> None:
    store = make(nbytes=100)
    store.put("a", "A", 40)
    store.put("b", "B", 40)
    assert store.put("c", "C", 90)  # room only for itself: both older ones go
    assert store.values() == ["C"]
    assert store.nbytes == 90
    store.put("d", "D", 10)
    assert store.values() == ["C", "D"]
    assert store.nbytes == 100  # at the budget is within it


def test_a_value_over_the_whole_budget_is_refused_and_changes_nothing() -> None:
    store = make(nbytes=100)
    store.put("a", "A", 60)
    assert not store.put("b", "B", 101)
    assert not store.put("a", "new", 101)  # nor does it replace what the key held
    assert store.values() == ["A"]
    assert store.nbytes == 60


def test_values_expire_their_ttl_after_they_were_stored() -> None:
    clock = Clock()
    store = make(ttl=60, clock=clock)
    store.put("a", "A", 10)
    clock.now = 30
    store.put("b", "B", 20)
    clock.now = 59.9
    assert store.values() == ["A", "B"]
    clock.now = 60
    assert store.get("a") is None
    assert store.get("b") == "B"
    assert (len(store), store.nbytes) == (1, 20)
    clock.now = 90
    assert len(store) == 0
    assert store.nbytes == 0


def test_storing_a_key_again_replaces_it_as_the_newest() -> None:
    clock = Clock()
    store = make(count=2, clock=clock)
    store.put("a", "A", 10)
    store.put("b", "B", 20)
    clock.now = 30
    assert store.put("a", "A2", 5)
    assert (len(store), store.nbytes) == (2, 25)
    assert store.values() == ["B", "A2"]
    store.put("c", "C", 1)  # past the count: "b" is now the oldest
    assert store.values() == ["A2", "C"]
    clock.now = 61  # "a" expires from its second storing, not its first
    assert store.values() == ["A2", "C"]
    clock.now = 90
    assert store.values() == []


def test_a_resized_value_keeps_its_place_and_the_others_make_room() -> None:
    clock = Clock()
    store = make(nbytes=100, clock=clock)
    store.put("a", "A", 30)
    clock.now = 10
    store.put("b", "B", 30)
    store.put("c", "C", 30)
    store.resize("a", 50)  # 110: the oldest other than "a" goes
    assert store.values() == ["A", "C"]
    assert store.nbytes == 80
    store.resize("a", 20)
    assert store.nbytes == 50
    clock.now = 60  # "a" kept the expiry of when it was stored
    assert store.values() == ["C"]
    assert store.nbytes == 30


def test_a_resized_value_over_the_budget_is_the_last_to_go() -> None:
    store = make(nbytes=100)
    store.put("a", "A", 30)
    store.put("b", "B", 30)
    store.resize("b", 150)
    assert store.values() == ["B"]
    assert store.nbytes == 150


def test_pop_gives_back_the_value_and_its_bytes() -> None:
    store = make()
    store.put("a", "A", 10)
    store.put("b", "B", 20)
    assert store.pop("a") == "A"
    assert store.pop("a") is None
    assert store.pop("nothing") is None
    assert (store.values(), store.nbytes) == (["B"], 20)
    assert store.pop("b") == "B"
    assert (len(store), store.nbytes) == (0, 0)


def test_no_room_in_any_bound_disables_it() -> None:
    assert make().enabled
    for limits in ((0, 1000, 60.0), (10, 0, 60.0), (10, 1000, 0.0)):
        assert not BoundedStore[str, str](*limits).enabled


class Mirror:
    """A `Backing` in a dict (insertion order: the order of puts), as SQLite's table keeps it."""

    def __init__(self) -> None:
        self.rows: dict[str, Row[str, str]] = {}

    def load(self) -> list[Row[str, str]]:
        return list(self.rows.values())

    def put(self, key: str, value: str, nbytes: int, expires_at: float) -> None:
        self.rows.pop(key, None)
        self.rows[key] = Row(key, value, nbytes, expires_at)

    def update(self, key: str, value: str, nbytes: int) -> None:
        self.rows[key] = attrs.evolve(self.rows[key], value=value, nbytes=nbytes)

    def delete(self, key: str) -> None:
        del self.rows[key]


def test_every_change_is_written_through_and_a_store_over_it_starts_with_it() -> None:
    clock, mirror = Clock(), Mirror()
    store = BoundedStore(3, 100, 60, clock, backing=mirror)
    for key in "abcd":  # "a" is pushed out
        store.put(key, key.upper(), 10)
    store.resize("b", 30)
    store.pop("c")
    assert [(r.key, r.value, r.nbytes, r.expires_at) for r in mirror.load()] == [
        ("b", "B", 30, 60),
        ("d", "D", 10, 60),
    ]
    again = BoundedStore(3, 100, 60, clock, backing=mirror)
    assert (again.values(), again.nbytes) == (["B", "D"], 40)
    smaller = BoundedStore(3, 20, 60, clock, backing=mirror)  # the bytes shrank: "b" goes
    assert smaller.values() == ["D"]
    assert list(mirror.rows) == ["d"]
    clock.now = 60
    assert BoundedStore(3, 100, 60, clock, backing=mirror).values() == []
    assert mirror.rows == {}
