from vpscluster.cli import main

raise SystemExit(main())
