"""`python -m moeflow.cli ARGS`, the same as `moeflow ARGS`."""

from moeflow.cli.main import main

raise SystemExit(main())
