"""`python -m tilewise.cli ...` (how the --nproc relaunch under torchrun runs the command)."""

from . import main

main()
