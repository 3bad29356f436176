"""A restart: agree on the newest step every rank holds, restore it, and account for the time.

- ``agree``    which step: the newest every pipeline stage can reach, computed alike on every rank
- ``restore``  loading that step into the engine, all ranks or none; refusing a silent fresh start
- ``adopt``    a job's first start under baft, from its DeepSpeed checkpoint
- ``record``   the T0..T4 of every restart, written after the first resumed iteration and read back
- ``chaos``    fault injection (kill, hang, corrupt) for tests and experiments
- ``inspect``  describe and verify a snapshot in shared memory or on disk

May import ``pipeline``, ``snapshot`` and ``manager``; never ``cli``.
"""
