from visenc.cli import main

raise SystemExit(main())
