"""Example jobs: small models written with plain ops, used by the README quickstart,
the benchmark and the tests."""
