from slm_align.cli import main

main()
