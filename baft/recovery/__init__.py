"""A restart: agree on the newest step every rank holds, restore it, and account for the time.

- ``restore``  agreement on the step, loading it into the engine, the T0..T4 marks
- ``report``   the recovery record, read back and drawn
- ``chaos``    fault injection (kill, hang, corrupt) for tests and experiments
- ``inspect``  describe and verify a snapshot in shared memory or on disk

May import ``pipeline``, ``snapshot`` and ``manager``; never ``cli``.
"""
