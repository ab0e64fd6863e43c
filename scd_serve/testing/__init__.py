"""Test seams that ship with the package, never reachable from a production flag: fault wrappers
(`faults`), the in-process soak stack (`soak`), a stand-in runtime and client (`fake_*`)."""
