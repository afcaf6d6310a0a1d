"""One module per process kind (``kvpool serve`` and its launcher, ``worker``, ``conductor``)
and the helpers they share (``common``). The library below never imports them."""
