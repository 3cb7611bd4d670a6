"""`python -m dlm` runs the command-line app (torchrun uses this form too)."""

from dlm.cli import main

if __name__ == "__main__":
    main()
