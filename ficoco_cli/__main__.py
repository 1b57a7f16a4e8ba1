"""`python -m ficoco_cli ARGS`: the `ficoco` command without its console script (a source checkout on
PYTHONPATH, never installed: benchmarks/gpu_run.sh on a machine without network)."""

from ficoco_cli.app import main

main()
