from ralm.cli import main

main()
