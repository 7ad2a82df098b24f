"""spotrun's elastic launcher: a torchrun drop-in whose agents meet through an etcd v3 rendezvous."""

__version__ = "0.1.0"
