from epo_cli.cli import main

main()
