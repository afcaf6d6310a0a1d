"""What the tests share (``tests/`` is on ``sys.path``: ``from support.procs import Proc``).

- ``process``: the one process wrapper (``Process``): a child process with a log, a JSON ready
  line, a stdin command channel, pause/resume and a bounded stop; every wait bounded.
- ``procs``: ``kvpool`` commands on it: ``Proc`` (a subcommand that prints one JSON line when
  ready), ``serve`` (a ``kvpool serve`` fixture), ``kvpool_cmd``, ``wait_healthy``.
- ``etcd``: ``EtcdProcess``, a real single-member etcd; ``ports``: ``free_port``.
- ``transfer``: ``PeerProcess`` (a ``kvpool transfer peer`` driven over stdin) and the
  transfer tests' fixtures; ``raw_rpc``: hand-made RPC peers (raw sockets).
"""
