"""netdist under the schedulers people get machines from.

``test_slurm.py`` submits the jobs of docs/slurm.md to a real Slurm cluster whose nodes
are hosts of their own (``slurm_cluster``, built from ``slurm_conf``; root, Slurm and
munge needed: ``slurm_missing()``). ``test_kubernetes.py`` runs the pods of
docs/kubernetes.md's manifests as local processes with the environment their controllers
set (``k8s_pods``), as no kubelet runs here.
"""
