"""One module per collective family: check the arguments, ask ``routes`` for the
algorithm, run it.

Each family module offers ``prepare_*`` functions with the ``Group`` method's
arguments. A ``prepare_*`` function runs at issue, on the caller's task: it checks the
arguments (raising before any tag is taken on a wrong one), plans the route and takes the
route's one-host turn, and returns the ``Body`` that ``Group`` runs under the call's
deadline, now or as a ``Work``. ``Group`` itself holds no algorithm and no route choice:

- ``all_reduce``: ``all_reduce`` and its eager start on the caller's thread
- ``scatter_gather``: ``reduce_scatter``, ``all_gather``
- ``rooted``: ``broadcast``, ``reduce``, ``gather``, ``scatter``
- ``exchange``: ``all_to_all``, ``barrier``, ``monitored_barrier``, the object collectives
- ``p2p``: ``send``, ``recv``, ``recv_any``

``context.OpContext`` is what an operation sees of its group; ``arguments`` holds the
argument checks every family shares.

Reduction semantics. ``SUM``/``PROD`` wrap around on integer overflow (NumPy semantics).
``MEAN`` sums, then divides once by the group size. On integer dtypes it is NCCL's
average (what torch's ``ReduceOp.AVG`` gives on NCCL): the sum wraps in the element type
as ``SUM`` does, and the one division is C's, truncating toward zero for signed types
(-7 / 2 is -3) and plain for unsigned ones (``reduce_kernels.divide_into``), the same bits
on every route. ``MEAN`` of ``bool`` raises ``TypeError`` (NCCL has none either).
``BAND``/``BOR``/``BXOR`` are bitwise and defined for integers and bool only. For
``bool``: ``SUM`` and ``MAX`` are logical or, ``PROD`` and ``MIN`` logical and.

Torch tensors. Every collective that takes NumPy arrays also takes CPU tensors
(``netdist.tensors``): a contiguous tensor is used through a NumPy view of its own memory,
with no copy; an in-place collective returns the tensor it was given, the others return
tensors over their result buffers (``torch.from_numpy``), ``out=`` tensors are filled in
place. A non-contiguous tensor follows the rule for non-contiguous arrays: one contiguous
copy, copied back into the tensor by in-place collectives (and into a non-contiguous
``out=`` tensor). A tensor off the CPU raises ``ValueError``. bfloat16 tensors need no
extra package: without ``ml_dtypes`` they travel as raw 16-bit data and reduce as torch
reduces bfloat16 (float32 per pairwise step, rounded to nearest even; see
``netdist.types``). A NumPy caller without ``ml_dtypes`` that *receives* bfloat16 (``recv``,
``gather``, ``scatter`` without ``out=``) gets a ``torch.bfloat16`` tensor if torch is
imported, else a ``TypeError`` naming the dtype and ``pip install 'netdist[bf16]'``.
"""
