from ablate.cli import main

main()
