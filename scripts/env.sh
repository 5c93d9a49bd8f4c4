# Sourced by the scripts: points gpu-checkpoint and the tests at the project's own tools.
