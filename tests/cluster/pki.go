package main

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"
)

// pki holds the paths of the key material kube-local generates on each start.
// One CA signs the serving certificate and the admin client certificate (so it
// doubles as --client-ca-file); a separate key signs service-account tokens.
type pki struct {
	caCert, caKey             string
	servingCert, servKey      string
	adminCert, adminKey       string
	saKey                     string // private key: signing key and (it contains the public part) verification key
	caPEM                     []byte
	adminCertPEM, adminKeyPEM []byte
}

func newKey() (*ecdsa.PrivateKey, error) {
	return ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
}

func keyPEM(k *ecdsa.PrivateKey) ([]byte, error) {
	der, err := x509.MarshalECPrivateKey(k)
	if err != nil {
		return nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: der}), nil
}

func certPEM(der []byte) []byte {
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
}

func serial() (*big.Int, error) {
	return rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 120))
}

func writeFile(path string, data []byte, mode os.FileMode) error {
	if err := os.WriteFile(path, data, mode); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	return nil
}

// generatePKI writes a fresh CA, serving cert (for the given IPs and DNS
// names), an admin client cert in group system:masters and a service-account
// key into dir. reuse: keep the ones already there (a restart: kubeconfigs and
// ServiceAccount tokens issued before stay valid).
func generatePKI(dir string, reuse bool, ips []net.IP, dnsNames []string) (*pki, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	p := &pki{
		caCert:      filepath.Join(dir, "ca.crt"),
		caKey:       filepath.Join(dir, "ca.key"),
		servingCert: filepath.Join(dir, "apiserver.crt"),
		servKey:     filepath.Join(dir, "apiserver.key"),
		adminCert:   filepath.Join(dir, "admin.crt"),
		adminKey:    filepath.Join(dir, "admin.key"),
		saKey:       filepath.Join(dir, "sa.key"),
	}
	if reuse {
		complete := true
		for _, f := range []string{p.caCert, p.caKey, p.servingCert, p.servKey, p.adminCert, p.adminKey, p.saKey} {
			if _, err := os.Stat(f); err != nil {
				complete = false
			}
		}
		if complete {
			var err error
			if p.caPEM, err = os.ReadFile(p.caCert); err != nil {
				return nil, err
			}
			if p.adminCertPEM, err = os.ReadFile(p.adminCert); err != nil {
				return nil, err
			}
			if p.adminKeyPEM, err = os.ReadFile(p.adminKey); err != nil {
				return nil, err
			}
			return p, nil
		}
	}
	now := time.Now().Add(-time.Hour)
	notAfter := now.Add(10 * 365 * 24 * time.Hour)

	caKey, err := newKey()
	if err != nil {
		return nil, err
	}
	sn, err := serial()
	if err != nil {
		return nil, err
	}
	caTmpl := &x509.Certificate{
		SerialNumber:          sn,
		Subject:               pkix.Name{CommonName: "kube-local-ca"},
		NotBefore:             now,
		NotAfter:              notAfter,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature | x509.KeyUsageCRLSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, caKey.Public(), caKey)
	if err != nil {
		return nil, err
	}
	ca, err := x509.ParseCertificate(caDER)
	if err != nil {
		return nil, err
	}
	p.caPEM = certPEM(caDER)

	issue := func(tmpl *x509.Certificate) ([]byte, []byte, error) {
		k, err := newKey()
		if err != nil {
			return nil, nil, err
		}
		sn, err := serial()
		if err != nil {
			return nil, nil, err
		}
		tmpl.SerialNumber = sn
		tmpl.NotBefore = now
		tmpl.NotAfter = notAfter
		tmpl.KeyUsage = x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment
		tmpl.BasicConstraintsValid = true
		der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, k.Public(), crypto.Signer(caKey))
		if err != nil {
			return nil, nil, err
		}
		kp, err := keyPEM(k)
		if err != nil {
			return nil, nil, err
		}
		return certPEM(der), kp, nil
	}

	servCert, servKey, err := issue(&x509.Certificate{
		Subject:     pkix.Name{CommonName: "kube-apiserver"},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		IPAddresses: ips,
		DNSNames:    dnsNames,
	})
	if err != nil {
		return nil, err
	}
	p.adminCertPEM, p.adminKeyPEM, err = issue(&x509.Certificate{
		Subject:     pkix.Name{CommonName: "kube-local-admin", Organization: []string{"system:masters"}},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	})
	if err != nil {
		return nil, err
	}
	saKey, err := newKey()
	if err != nil {
		return nil, err
	}
	saPEM, err := keyPEM(saKey)
	if err != nil {
		return nil, err
	}
	caKeyPEM, err := keyPEM(caKey)
	if err != nil {
		return nil, err
	}

	for _, f := range []struct {
		path string
		data []byte
		mode os.FileMode
	}{
		{p.caCert, p.caPEM, 0o644},
		{p.caKey, caKeyPEM, 0o600},
		{p.servingCert, servCert, 0o644},
		{p.servKey, servKey, 0o600},
		{p.adminCert, p.adminCertPEM, 0o644},
		{p.adminKey, p.adminKeyPEM, 0o600},
		{p.saKey, saPEM, 0o600},
	} {
		if err := writeFile(f.path, f.data, f.mode); err != nil {
			return nil, err
		}
	}
	return p, nil
}
