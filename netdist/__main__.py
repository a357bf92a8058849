"""``python -m netdist``: the same as the ``netdist`` command."""

from netdist.cli.main import main

raise SystemExit(main())
