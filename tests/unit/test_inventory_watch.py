"""The agent sends its inventory again when it changes (agent/daemon.py InventoryWatch)."""

from xpusense.agent.daemon import InventoryWatch


def test_a_changed_inventory_is_sent_again_and_an_unchanged_one_is_not():
    now = [0.0]
    inv = {"resources": [{"type": "GPU", "id": "gpu0"}, {"type": "GPU", "id": "gpu1"}]}
    computed, changes = [], []

    def compute():
        computed.append(now[0])
        return {"resources": list(inv["resources"])}

    w = InventoryWatch(compute, lambda: changes.append(now[0]), period_s=60.0, clock=lambda: now[0])
    w.check([])                      # first look: remembered, nothing to say
    now[0] = 30.0
    w.check([])                      # within the period and no events: not even computed
    assert computed == [0.0] and changes == []
    inv["resources"] = inv["resources"][:1]   # gpu1 lost
    w.check(["gpu_lost"])            # events make it look at once
    assert computed == [0.0, 30.0] and changes == [30.0]
    now[0] = 200.0
    w.check([])                      # period over, unchanged: computed, not sent
    assert computed == [0.0, 30.0, 200.0] and changes == [30.0]
