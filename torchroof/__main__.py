from torchroof.cli.main import console

raise SystemExit(console())
