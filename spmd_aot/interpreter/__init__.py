"""The interpreter: a checked graph run op by op, with the checks that hold while it runs.

``program`` turns decoded nodes into a ``Program`` (each op called through its handle, arguments
gathered by precomputed getters, values freed after their last use) and runs it;
``invariants`` compares every value a later op reads with the metadata the load's meta check
derived; ``constant_fold`` computes once, at load, the values that depend on no input;
``program_form`` is a ``ProgramTable``'s stored form (ops by name, the rest plain data) and the
identity of the code that builds one. Below ``entries/`` (an entry becomes a ``Program``) and
``building/`` (a signed build stores its checked program), so it reads no store and no key.
"""
