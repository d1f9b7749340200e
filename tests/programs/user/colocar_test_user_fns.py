"""User code that record pipelines name by "module:function".

test_loader_sources.py copies this file into a temporary directory that it puts on sys.path
(and on a child process's PYTHONPATH), as a user's own module would be. It lives apart from
the programs so that random_map_child.py imports the copy, not this file.
"""


def make_source():
    return [{"x": i * i} for i in range(25)]


def make_bad_source():
    return 42


def jitter(rec, rng):
    return {**rec, "noise": rng.random(3), "k": int(rng.integers(0, 1 << 30))}


def double(rec):
    return {**rec, "index": rec["index"] * 2}


def keep_even(rec):
    return int(rec["index"]) % 2 == 0


def explode_on_7(rec):
    if int(rec["index"]) % 10 == 7:
        raise ValueError(f"bad record {int(rec['index'])}")
    return rec


class Holder:
    class Inner:
        @staticmethod
        def make():
            return list(range(5))
