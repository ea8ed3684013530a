import sys

from verispec.kernels import main

sys.exit(main())
