"""The tenant label's values stay bounded: the first tenants keep their names, later ones share `other`."""

from scheduler_svc.metrics import OTHER_TENANT, TenantLabels


def test_the_first_tenants_keep_their_names_the_rest_are_other():
    label = TenantLabels(max_labels=2)
    assert [label(t) for t in ("a", "", "c", "a", "d", "")] == ["a", "", OTHER_TENANT, "a", OTHER_TENANT, ""]


def test_a_tenant_named_other_is_other():
    label = TenantLabels(max_labels=4)
    assert label(OTHER_TENANT) == OTHER_TENANT and label.named == set()
