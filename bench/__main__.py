"""`python -m bench`: the engine benchmark (bench/engine.py)."""

from bench.engine import main

if __name__ == "__main__":
    main()
