"""The highly available control plane's edge on etcd v3: the client
(:mod:`daemon.ha.client`), the election (:mod:`daemon.ha.elector`, driving the pure
:mod:`daemon.control.leadership`) and the fenced commits (:mod:`daemon.ha.fence`)."""
