"""``python -m spdkfac.train``: the training job (see :mod:`spdkfac.train.job`)."""

from .job import main

if __name__ == "__main__":
    main()
