import os
import sys

# Tests import the helpers beside them (harness, reference) as top-level modules.
sys.path.insert(0, os.path.dirname(__file__))
