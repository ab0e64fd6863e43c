"""Test seams that ship with the package: fakes, fault injection and the soak driver.

Nothing here is reachable from a production flag; tests, the soak run and benchmarks compose
these around the real objects (`faults`), run a whole decode stack in one process (`soak`),
or stand in for a model runtime (`fake_runtime`).
"""
