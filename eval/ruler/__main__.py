"""``python -m eval.ruler --help``: see eval/ruler/cli.py."""
from eval.ruler.cli import main

if __name__ == "__main__":
    main()
