// Command oci-image builds the operator's container image without a container
// engine: it reads the final stage of the Containerfile (FROM scratch, COPY
// --from=<stage>, USER, LABEL, ENTRYPOINT, CMD, ARG), takes the files the
// build stage would have produced from a local directory, and writes an OCI
// image layout (directory and tarball) with go-containerregistry.
//
//	oci-image -containerfile Containerfile -stage build:/out/rootfs=/tmp/rootfs \
//	    -build-arg VERSION=0.1.0 -out target/image/gpu-sharing-operator
//
// writes <out>/ (an OCI image layout), <out>.tar (the same layout as a tar,
// for `podman load` or `skopeo copy oci-archive:`) and prints a JSON summary.
package main

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"runtime"
	"sort"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

type multiFlag map[string]string

func (m multiFlag) String() string { return fmt.Sprint(map[string]string(m)) }
func (m multiFlag) Set(v string) error {
	k, val, ok := strings.Cut(v, "=")
	if !ok {
		return fmt.Errorf("want KEY=VALUE, got %q", v)
	}
	m[k] = val
	return nil
}

// Stage is what the final stage of a Containerfile says.
type Stage struct {
	Copies     []Copy            `json:"copies"`
	User       string            `json:"user"`
	Labels     map[string]string `json:"labels"`
	Entrypoint []string          `json:"entrypoint"`
	Cmd        []string          `json:"cmd"`
}

// Copy is one `COPY --from=<stage> <src> <dst>`.
type Copy struct {
	From, Src, Dst string
}

var argRef = regexp.MustCompile(`\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)`)

// parseFinalStage reads the instructions after the last FROM, which must be
// `FROM scratch`; ARG defaults (global and in-stage) and build args are
// substituted. Instructions this builder cannot reproduce are errors.
func parseFinalStage(text string, buildArgs map[string]string) (*Stage, error) {
	lines := strings.Split(strings.ReplaceAll(text, "\\\n", " "), "\n")
	args := map[string]string{}
	subst := func(s string) string {
		return argRef.ReplaceAllStringFunc(s, func(m string) string {
			name := strings.Trim(m, "${}")
			return args[name]
		})
	}
	var st *Stage
	for i, raw := range lines {
		line := strings.TrimSpace(raw)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		instr, rest, _ := strings.Cut(line, " ")
		rest = strings.TrimSpace(rest)
		switch strings.ToUpper(instr) {
		case "FROM":
			st = &Stage{Labels: map[string]string{}}
			if f := strings.Fields(subst(rest)); len(f) == 0 || f[0] != "scratch" {
				st = nil // a build stage: its instructions are the build's, not ours
			}
		case "ARG":
			name, def, _ := strings.Cut(rest, "=")
			if v, ok := buildArgs[name]; ok {
				def = v
			}
			args[name] = strings.Trim(subst(def), `"`)
		default:
			if st == nil {
				continue
			}
			if err := st.add(strings.ToUpper(instr), subst(rest)); err != nil {
				return nil, fmt.Errorf("line %d: %w", i+1, err)
			}
		}
	}
	if st == nil {
		return nil, fmt.Errorf("the final stage is not FROM scratch")
	}
	return st, nil
}

func (st *Stage) add(instr, rest string) error {
	switch instr {
	case "COPY":
		f := strings.Fields(rest)
		if len(f) != 3 || !strings.HasPrefix(f[0], "--from=") {
			return fmt.Errorf("only COPY --from=<stage> <src> <dst> is supported, got COPY %s", rest)
		}
		st.Copies = append(st.Copies, Copy{From: strings.TrimPrefix(f[0], "--from="), Src: f[1], Dst: f[2]})
	case "USER":
		st.User = rest
	case "LABEL":
		for _, kv := range splitLabels(rest) {
			k, v, ok := strings.Cut(kv, "=")
			if !ok {
				return fmt.Errorf("LABEL %q: want key=value", kv)
			}
			st.Labels[k] = strings.Trim(v, `"`)
		}
	case "ENTRYPOINT":
		return json.Unmarshal([]byte(rest), &st.Entrypoint)
	case "CMD":
		return json.Unmarshal([]byte(rest), &st.Cmd)
	default:
		return fmt.Errorf("instruction %s in the final stage is not supported by this builder", instr)
	}
	return nil
}

// splitLabels splits `a="x y" b=z` on spaces outside quotes.
func splitLabels(s string) []string {
	var out []string
	var cur strings.Builder
	quoted := false
	for _, r := range s {
		switch {
		case r == '"':
			quoted = !quoted
			cur.WriteRune(r)
		case r == ' ' && !quoted:
			if cur.Len() > 0 {
				out = append(out, cur.String())
				cur.Reset()
			}
		default:
			cur.WriteRune(r)
		}
	}
	if cur.Len() > 0 {
		out = append(out, cur.String())
	}
	return out
}

// layerTar writes the copied trees as one tar: root-owned, mtime epoch,
// sorted, so the same files give the same layer digest.
func layerTar(st *Stage, stages map[string]string) ([]byte, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	epoch := time.Unix(0, 0)
	for _, c := range st.Copies {
		src := ""
		for k, dir := range stages {
			stage, prefix, _ := strings.Cut(k, ":")
			if rest, ok := strings.CutPrefix(filepath.Clean(c.Src), filepath.Clean(prefix)); stage == c.From && ok {
				src = filepath.Join(dir, rest)
			}
		}
		if src == "" {
			return nil, fmt.Errorf("COPY --from=%s %s: no -stage %s:<path>=<dir> covers it", c.From, c.Src, c.From)
		}
		var paths []string
		err := filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			paths = append(paths, p)
			return nil
		})
		if err != nil {
			return nil, err
		}
		sort.Strings(paths)
		for _, p := range paths {
			rel, _ := filepath.Rel(src, p)
			name := filepath.ToSlash(filepath.Join(strings.TrimPrefix(c.Dst, "/"), rel))
			if rel == "." {
				continue
			}
			info, err := os.Lstat(p)
			if err != nil {
				return nil, err
			}
			h := &tar.Header{Name: name, Mode: int64(info.Mode().Perm()), ModTime: epoch, Format: tar.FormatPAX}
			if info.IsDir() {
				h.Typeflag, h.Name = tar.TypeDir, name+"/"
				if err := tw.WriteHeader(h); err != nil {
					return nil, err
				}
				continue
			}
			h.Typeflag, h.Size = tar.TypeReg, info.Size()
			if err := tw.WriteHeader(h); err != nil {
				return nil, err
			}
			f, err := os.Open(p)
			if err != nil {
				return nil, err
			}
			_, err = io.Copy(tw, f)
			f.Close()
			if err != nil {
				return nil, err
			}
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

func build(st *Stage, stages map[string]string, arch string) (v1.Image, error) {
	data, err := layerTar(st, stages)
	if err != nil {
		return nil, err
	}
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(data)), nil
	}, tarball.WithCompressionLevel(gzip.BestCompression), tarball.WithMediaType(types.OCILayer))
	if err != nil {
		return nil, err
	}
	img := mutate.MediaType(empty.Image, types.OCIManifestSchema1)
	img = mutate.ConfigMediaType(img, types.OCIConfigJSON)
	img, err = mutate.Append(img, mutate.Addendum{Layer: layer, History: v1.History{CreatedBy: "COPY --from=build /out/rootfs/ / (tests/image)"}})
	if err != nil {
		return nil, err
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = "linux", arch
	cf.Config.User = st.User
	cf.Config.Entrypoint = st.Entrypoint
	cf.Config.Cmd = st.Cmd
	cf.Config.Labels = st.Labels
	cf.Created = v1.Time{Time: time.Unix(0, 0).UTC()}
	return mutate.ConfigFile(img, cf)
}

// tarDir writes the directory dir as a tar file.
func tarDir(dir, out string) error {
	f, err := os.Create(out)
	if err != nil {
		return err
	}
	defer f.Close()
	tw := tar.NewWriter(f)
	err = filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || p == dir {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		info, err := d.Info()
		if err != nil {
			return err
		}
		h, err := tar.FileInfoHeader(info, "")
		if err != nil {
			return err
		}
		h.Name = filepath.ToSlash(rel)
		if d.IsDir() {
			h.Name += "/"
		}
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		if d.IsDir() {
			return nil
		}
		src, err := os.Open(p)
		if err != nil {
			return err
		}
		defer src.Close()
		_, err = io.Copy(tw, src)
		return err
	})
	if err != nil {
		return err
	}
	return tw.Close()
}

func main() {
	containerfile := flag.String("containerfile", "Containerfile", "the Containerfile")
	out := flag.String("out", "", "output path: <out>/ is the OCI layout, <out>.tar its tarball (required)")
	arch := flag.String("arch", runtime.GOARCH, "image architecture")
	stages, buildArgs := multiFlag{}, multiFlag{}
	flag.Var(stages, "stage", "NAME:PATH=DIR: the local directory holding what stage NAME has at PATH (repeatable)")
	flag.Var(buildArgs, "build-arg", "KEY=VALUE (repeatable)")
	flag.Parse()
	if err := run(*containerfile, *out, *arch, stages, buildArgs); err != nil {
		fmt.Fprintln(os.Stderr, "oci-image:", err)
		os.Exit(1)
	}
}

func run(containerfile, out, arch string, stages, buildArgs map[string]string) error {
	if out == "" {
		return fmt.Errorf("-out is required")
	}
	text, err := os.ReadFile(containerfile)
	if err != nil {
		return err
	}
	st, err := parseFinalStage(string(text), buildArgs)
	if err != nil {
		return err
	}
	img, err := build(st, stages, arch)
	if err != nil {
		return err
	}
	if err := os.RemoveAll(out); err != nil {
		return err
	}
	p, err := layout.Write(out, empty.Index)
	if err != nil {
		return err
	}
	ref := "gpu-sharing-operator:" + st.Labels["org.opencontainers.image.version"]
	if err := p.AppendImage(img, layout.WithAnnotations(map[string]string{"org.opencontainers.image.ref.name": ref})); err != nil {
		return err
	}
	if err := tarDir(out, out+".tar"); err != nil {
		return err
	}
	digest, _ := img.Digest()
	layers, _ := img.Layers()
	var compressed int64
	for _, l := range layers {
		s, _ := l.Size()
		compressed += s
	}
	summary := map[string]any{"ref": ref, "digest": digest.String(), "layers": len(layers), "compressedBytes": compressed, "stage": st}
	return json.NewEncoder(os.Stdout).Encode(summary)
}
