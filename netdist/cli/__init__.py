"""The ``netdist`` command line: ``netdist launch | worker | demo | bench | ckpt ...``.

``netdist.cli.main`` builds the parser; each subcommand lives in its own module here.
Library code never imports this package; it is the one place that picks the event loop
(``netdist.cli.loop``).
"""
