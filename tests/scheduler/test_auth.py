"""API keys (scheduler_svc.auth) and TLS files (pagedserve_common.tls): parsing, the constant-time check, errors."""

from __future__ import annotations

import hmac
import stat

import pytest

from pagedserve_cli.certs_cmd import dev_certificates
from pagedserve_cli.main import main
from pagedserve_common.tls import TlsConfigError, TlsFiles, certificate_names
from scheduler_svc.auth import (DUPLICATE, INVALID, MISSING, ApiKeyFileError, ApiKeys, load_keys,
                                read_key_identities, read_keys, read_named_keys)
from scheduler_svc.identity import GATEWAY, MIN_PRIORITY, OPERATOR, TENANT, Identity


def write(tmp_path, text: str, name: str = "keys"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_key_file_one_a_line_ignoring_blanks_and_comments(tmp_path):
    path = write(tmp_path, "# clients\n\n  alpha-1  \n\t\n# beta-2 is retired\nGamma_3\n")
    assert read_keys(path) == ["alpha-1", "Gamma_3"]
    keys = load_keys(path)
    assert len(keys) == 2 and keys.check("alpha-1") and keys.check("Gamma_3")
    assert not keys.check("beta-2") and not keys.check("alpha-") and not keys.check("alpha-12")
    assert not keys.check("gamma_3") and not keys.check("")


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n  # indented too\n"])
def test_a_key_file_without_keys_is_an_error(tmp_path, text):
    with pytest.raises(ApiKeyFileError, match="--api-key-file .*: no key in it"):
        load_keys(write(tmp_path, text))


def test_a_bad_line_names_its_number_not_the_key(tmp_path):
    with pytest.raises(ApiKeyFileError, match="line 3") as e:
        load_keys(write(tmp_path, "# x\nok-key\nsecr\u00e9t team\n"))
    assert "secr" not in str(e.value)


def test_a_key_may_be_named_by_the_rest_of_its_line_its_tenant(tmp_path):
    path = write(tmp_path, "alpha-1 team a\nbeta-2\t \n gamma-3   team-b  \ndelta-4 team a\n")
    assert read_named_keys(path) == [("alpha-1", "team a"), ("beta-2", ""), ("gamma-3", "team-b"),
                                     ("delta-4", "team a")]
    assert read_keys(path) == ["alpha-1", "beta-2", "gamma-3", "delta-4"]  # what a client sends: the key alone
    keys = load_keys(path)
    assert [keys.name_of([f"Bearer {k}"]) for k in ("alpha-1", "beta-2", "gamma-3", "delta-4")] == \
        ["team a", "", "team-b", "team a"]
    assert keys.name_of(["Bearer nope"]) == "" and keys.name_of([]) == ""


def test_a_key_name_is_visible_ascii_up_to_the_tenant_limit(tmp_path):
    with pytest.raises(ApiKeyFileError, match="line 2: KEY \\[NAME\\]: the name is at most 128"):
        load_keys(write(tmp_path, "k1 ok\nk2 " + "n" * 129 + "\n"))
    with pytest.raises(ApiKeyFileError, match="line 1: KEY \\[NAME\\]: the name"):
        load_keys(write(tmp_path, "k1 caf\u00e9\n"))
    assert load_keys(write(tmp_path, "k1 " + "n" * 128 + "\n")).names == ("n" * 128,)


def test_a_key_line_may_end_with_a_role_and_a_priority_cap(tmp_path):
    path = write(tmp_path, "k1 team a max-priority=-5\nk2 role=operator\nk3 gw role=gateway max-priority=2\n"
                           "k4 team-b\nk5 a=b c\nk6 ops max-priority=0 role=operator\n")
    assert read_key_identities(path) == [
        ("k1", Identity("team a", TENANT, -5)), ("k2", Identity("", OPERATOR, MIN_PRIORITY)),
        ("k3", Identity("gw", GATEWAY, 2)), ("k4", Identity("team-b", TENANT, 0)), ("k5", Identity("a=b c")),
        ("k6", Identity("ops", OPERATOR, 0))]
    assert read_named_keys(path)[0] == ("k1", "team a") and read_keys(path)[:2] == ["k1", "k2"]
    keys = load_keys(path)
    assert keys.identity_of(["Bearer k3"]) == Identity("gw", GATEWAY, 2)
    assert keys.identity_of(["Bearer nope"]) == Identity() and keys.identity_of([]) == Identity()  # the least
    assert keys.identity_of_http([("x-api-key", "k2")]).sees_all
    assert not keys.identity_of(["Bearer k4"]).names_tenants and keys.identity_of(["Bearer k3"]).names_tenants


@pytest.mark.parametrize("line, why", [
    ("s3cr3t team role=admin", "role is one of tenant, gateway, operator, got 'admin'"),
    ("s3cr3t max-priority=high", "max-priority is an integer in -2147483648..2147483647, got 'high'"),
    ("s3cr3t max-priority=2147483648", "max-priority is an integer in"),
    ("s3cr3t team colour=red", "unknown attribute 'colour'"),
    ("s3cr3t role=gateway role=operator", "role is given twice"),
])
def test_a_bad_attribute_names_its_line_and_what_is_wrong(tmp_path, line, why):
    with pytest.raises(ApiKeyFileError, match="line 2: KEY \\[NAME\\] \\[max-priority=N\\]") as e:
        load_keys(write(tmp_path, f"ok-key\n{line}\n"))
    assert why in str(e.value) and "s3cr3t" not in str(e.value)


def test_a_worker_token_file_has_no_names(tmp_path):
    with pytest.raises(ApiKeyFileError, match="--worker-token-file .*: line 1: a token is printable ASCII without "
                                              "spaces"):
        read_keys(write(tmp_path, "tok-1 name\n"), "--worker-token-file", "token", named=False)


def test_an_unreadable_key_file_names_the_flag(tmp_path):
    with pytest.raises(ApiKeyFileError, match="--api-key-file .*missing.*cannot read it"):
        load_keys(str(tmp_path / "missing"))
    assert isinstance(ApiKeyFileError("x"), ValueError)  # the CLI reports ValueErrors as `error: ...`, exit 2


def test_keys_are_neither_kept_nor_shown_in_clear():
    keys = ApiKeys.of(["s3cret-key"])
    assert "s3cret" not in repr(keys) and all(b"s3cret" not in d for d in keys.digests)


def test_the_check_compares_against_every_key_in_constant_time(monkeypatch):
    keys = ApiKeys.of(["k1", "k2", "k3"])
    calls, real = [], hmac.compare_digest

    def spy(a, b):
        calls.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr("scheduler_svc.auth.hmac.compare_digest", spy)
    for presented in ("k1", "k3", "nope", "a much longer key than any of them"):
        calls.clear()
        keys.check(presented)
        # NOTE: one comparison per key whatever matched (no early exit), always of equal-length digests.
        assert calls == [(32, 32)] * 3, presented


@pytest.mark.parametrize("header, why", [
    ("Bearer k1", None), ("bearer k1", None), ("BEARER   k1 ", None), (b"Bearer k1", None),
    (None, MISSING), ("", MISSING), ("k1", MISSING), ("Basic k1", MISSING), ("Bearer ", MISSING),
    ("Bearer k2", INVALID), ("Bearer k1x", INVALID),
])
def test_the_authorization_value(header, why):
    assert ApiKeys.of(["k1"]).refusal(header) == why


@pytest.mark.parametrize("headers, why", [
    ([], MISSING), ([("authorization", "Bearer k1")], None), ([("x", "y"), ("authorization", "Bearer k2")], INVALID),
    ([("authorization", "Bearer k1"), ("authorization", "Bearer k1")], DUPLICATE),
    ([("authorization", "Bearer k2"), ("authorization", "Bearer k1")], DUPLICATE),
    ([(b"authorization", b"Bearer k1"), (b"authorization", b"Bearer k2")], DUPLICATE),
])
def test_one_authorization_header_or_none(headers, why):
    name = headers[0][0] if headers and isinstance(headers[0][0], bytes) else "authorization"
    assert ApiKeys.of(["k1"]).refusal_of(headers, name) == why


def test_tls_files_name_the_missing_flag(tmp_path):
    with pytest.raises(TlsConfigError, match="--tls-cert needs --tls-key"):
        TlsFiles(cert="a.pem")
    with pytest.raises(TlsConfigError, match="--tls-key needs --tls-cert"):
        TlsFiles(key="a.pem")
    with pytest.raises(TlsConfigError, match=r"--tls-ca .*nothere\.pem: cannot read it"):
        TlsFiles(ca=str(tmp_path / "nothere.pem")).client_pems()
    with pytest.raises(TlsConfigError, match="--tls-cert .*: not a PEM file"):
        TlsFiles(write(tmp_path, "junk", "c.pem"), write(tmp_path, "junk", "k.pem")).server_pems(False)
    with pytest.raises(TlsConfigError, match="--tls-ca needs --tls-cert"):
        TlsFiles(ca="ca.pem").serves_tls()
    assert TlsFiles().client_pems() is None and not TlsFiles().serves_tls()  # no flag: plaintext


def test_tls_files_that_do_not_hold_what_their_flag_says_are_named(tmp_path):
    """Caught when the files are read, naming the flag and the path (gRPC would say "Invalid cert chain file" on a
    C++ log line, then fail to bind)."""
    from cryptography.hazmat.primitives import serialization

    files = {name: write(tmp_path, pem.decode(), name) for name, pem in dev_certificates().items()}
    garbage = write(tmp_path, "-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydA==\n-----END CERTIFICATE-----\n", "bad.pem")
    encrypted = write(tmp_path, load_key(files["server-key.pem"]).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"secret")).decode(), "locked.pem")
    cases = [(TlsFiles(garbage, files["server-key.pem"]), r"--tls-cert .*bad\.pem: not a valid PEM certificate"),
             (TlsFiles(files["server.pem"], files["server.pem"]), r"--tls-key .*server\.pem: not a valid PEM private"),
             (TlsFiles(files["server.pem"], encrypted), r"--tls-key .*locked\.pem: an encrypted private key"),
             (TlsFiles(files["server.pem"], files["worker-key.pem"]),
              r"--tls-key .*worker-key\.pem: not the private key of the certificate in --tls-cert .*server\.pem"),
             (TlsFiles(files["server.pem"], files["server-key.pem"], garbage), r"--tls-ca .*bad\.pem: not a valid")]
    for tls, match in cases:
        with pytest.raises(TlsConfigError, match=match):
            tls.server_pems(require_client_auth=bool(tls.ca))
    assert TlsFiles(files["server.pem"], files["server-key.pem"], files["ca.pem"]).server_pems(True)


def load_key(path: str):
    from cryptography.hazmat.primitives import serialization

    return serialization.load_pem_private_key(open(path, "rb").read(), password=None)


def test_certs_command_writes_the_files_keys_private(tmp_path, capsys):
    out = tmp_path / "certs"
    assert main(["certs", str(out), "--host", "llm.example", "--host", "10.1.2.3"]) == 0
    names = {"ca.pem", "server.pem", "server-key.pem", "worker.pem", "worker-key.pem", "api-keys"}
    assert {p.name for p in out.iterdir()} == names
    for name in ("server-key.pem", "worker-key.pem", "api-keys"):
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o600, name
    assert certificate_names(str(out / "server.pem")) == ["localhost", "scheduler", "llm.example", "127.0.0.1",
                                                          "10.1.2.3"]
    assert len(read_keys(str(out / "api-keys"))) == 1
    assert main(["certs", str(out)]) == 2  # does not overwrite
    assert "exist already" in capsys.readouterr().err
    assert main(["certs", str(out), "--force"]) == 0


def test_dev_certificates_verify_against_their_ca():
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    files = dev_certificates()
    ca = x509.load_pem_x509_certificate(files["ca.pem"])
    for name, usages in (("server.pem", {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}),
                         ("worker.pem", {ExtendedKeyUsageOID.CLIENT_AUTH})):
        cert = x509.load_pem_x509_certificate(files[name])
        cert.verify_directly_issued_by(ca)
        assert set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == usages
