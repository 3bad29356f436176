"""The per-node snapshot manager: the process that keeps snapshots alive when a trainer dies.

- ``server``    the manager process (``python -m baft.manager``): its sockets, dispatch and background loop
- ``ranks``     the node's ranks: their shared-memory slots, commits and verification
- ``parity``    the parity group: distribute this node's shares, hold the members', rebuild a lost node
- ``persister`` which step is due on disk, and the thread that writes it
- ``protocol``  its messages over a Unix socket, and the client a rank uses
- ``config``    its validated command line
- ``control``   start, stop and ask a manager for its status
- ``nodes``     one manager per node of a run
- ``erasure``   parity across nodes (Reed-Solomon) so a lost node's shards can be rebuilt
- ``persist``   committed snapshots on disk: the format, written atomically
- ``heartbeat`` a rank's heartbeat file, which lets its manager tell a hung rank from a slow one
- ``watchdog``  the manager's watch over the heartbeats: a hung rank is killed, for torchrun to relaunch
- ``inventory`` what a shared-memory directory holds: its node roots, their snapshots, their managers

May import ``snapshot`` (the slots and commit records it keeps); never ``recovery`` or above.
"""
