"""``python -m inference_lab.client …`` runs ``inference-lab load …``."""

from inference_lab.client.cli import main

raise SystemExit(main())
