"""`python -m accel.launch_single_task`: the command line's entry point, kept at this name for the
scripts and notebooks that call it (the command line itself lives in accel/cli/)."""

from accel.cli.launch import main

if __name__ == "__main__":
    raise SystemExit(main())
