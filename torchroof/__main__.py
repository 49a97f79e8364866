from torchroof.cli import main

raise SystemExit(main())
