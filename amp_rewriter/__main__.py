"""`python -m amp_rewriter` runs the CLI."""

from .cli import main

raise SystemExit(main())
