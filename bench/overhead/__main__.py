"""``python -m bench.overhead``: see the package docstring."""

from bench.overhead.run import main

if __name__ == "__main__":
    main()
