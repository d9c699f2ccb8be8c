"""``python -m mixerlab.eval.ruler --help``: see eval/ruler/cli.py."""
from mixerlab.eval.ruler.cli import main

if __name__ == "__main__":
    main()
