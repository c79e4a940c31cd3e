"""The key: what decides whether a stored step may serve this job, computed without tracing.

``key`` lists the named ingredients (one function each, each logged); ``fingerprint`` describes
live objects (model code, closures, attributes) deeply; ``guards`` records what only the trace
can know and checks it before a hit; ``lookup`` finds the newest entry whose guards hold;
``explain`` says why a lookup missed.
"""
