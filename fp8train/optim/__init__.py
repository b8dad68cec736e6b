"""The optimizer and its learning-rate schedule. Nothing is imported here: importing one module
loads only the modules it uses.

- optimizer.py   AdamW (fused, decay on matrices only), or Muon for the blocks' matrices with
                 AdamW for the rest; device-side skip of a non-finite step for both.
- muon.py        Muon's update: same-shape matrices orthogonalised in one batched call, each
                 data-parallel rank its share, compiled under compile: true.
- schedule.py    the learning rate: warmup, then cosine, warmup-stable-decay or linear; batch
                 scaling; the step of fp8_until's hand-over.
"""
