"""``python -m sqla_proletarian``: the command line, as the ``sqla-proletarian`` script."""

from sqla_proletarian.cli import main

raise SystemExit(main())
