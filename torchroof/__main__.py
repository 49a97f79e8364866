from torchroof.cli.main import main

raise SystemExit(main())
