"""Run by the image test under `horovodrun -np 2 --gloo`: sum and average allreduce must be exact."""

import horovod.torch as hvd
import torch

hvd.init()
x = torch.full((4,), float(hvd.rank() + 1))
total = hvd.allreduce(x, op=hvd.Sum)
average = hvd.allreduce(x)  # Horovod's default op is the average
assert hvd.size() == 2, hvd.size()
assert torch.equal(total, torch.full((4,), 3.0)), total
assert torch.equal(average, torch.full((4,), 1.5)), average
print(f"rank {hvd.rank()} of {hvd.size()}: allreduce ok (sum {total.tolist()}, average {average.tolist()})")
