"""etcd v3 rendezvous for torch.distributed.elastic (backend name ``etcd-v3``)."""
