"""Your script's own training loop: what baft reads of it and keeps with every snapshot, so a resumed run goes on as
the uninterrupted one did.

- ``loop``            a loop that counts its calls to ``train_batch``: replayed after a restore, kept in step in place
- ``history``         what such a loop's calls returned at each step, saved with every snapshot
- ``loop_source``     the loops around a call to ``train_batch``, read from the script's source
- ``counting``        whether such a loop counts its calls (``for step in range(n)``): a new process calls again
- ``carried_source``  the values of its own a loop carries from one iteration to the next, read from the source:
                      the loop's variables; through ``carried_attributes`` (its objects' attributes),
                      ``carried_globals`` (its modules' globals) and ``carried_cells`` (its closures' variables)
- ``starts``          whether the script starts such a value at nothing but a literal (not its own resume)
- ``source``          what both read of the source: syntax trees, assignments, the functions a loop reaches
- ``carry``           those values, kept with every snapshot and set again in a resumed loop
- ``attributes``      the plain values, tensors and lists the script's own modules hold as attributes (a count, a
                      running mean not in a buffer): those that change, kept
- ``main_globals``    the tensors the script's main file holds in globals (class weights the loss reads): those that
                      change, kept
- ``held``            how both tell a value changed since start, and what a snapshot keeps of it
- ``rng``             every random generator a step draws from: its state, and as JSON
- ``schedulers``      the learning-rate schedulers a script makes on the engine's optimizer itself

The bottom layer: imports nothing of baft but the base modules (``errors``, ``jsonfile``, ``config``).
"""
