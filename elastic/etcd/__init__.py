"""etcd v3: the client every part of the job uses, and an embedded server for demos and tests."""

from elastic.etcd.client import EtcdClient, EtcdOptions, parse_endpoints

__all__ = ["EtcdClient", "EtcdOptions", "parse_endpoints"]
