"""What the training jobs share: data sets, device choice, cluster checks, ONNX export + verify.

Imported by the jobs on the Ray driver and on every Ray worker (`ray job submit --working-dir .`
puts the repository root on the workers' PYTHONPATH; the jobs add it for direct runs).
"""
