from combee_stream.cli import main

raise SystemExit(main())
