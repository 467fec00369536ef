{{/* Names, labels and small computed values shared by the templates. */}}

{{- define "csi-pmem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The release-scoped base name of namespaced objects. */}}
{{- define "csi-pmem.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The node DaemonSet's name; "-node" is the suffix CSI deployments use by convention. */}}
{{- define "csi-pmem.nodeName" -}}
{{- printf "%s-node" (include "csi-pmem.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "csi-pmem.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "csi-pmem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "csi-pmem.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: node
{{- end -}}

{{- define "csi-pmem.labels" -}}
helm.sh/chart: {{ include "csi-pmem.chart" . }}
app.kubernetes.io/name: {{ include "csi-pmem.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: csi-pmem
{{- end -}}

{{- define "csi-pmem.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "csi-pmem.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* repository:tag of one image block; the driver's tag defaults to the appVersion. */}}
{{- define "csi-pmem.image" -}}
{{- $img := index . 0 -}}
{{- $ctx := index . 1 -}}
{{- printf "%s:%s" $img.repository (default $ctx.Chart.AppVersion $img.tag) -}}
{{- end -}}

{{/* Where kubelet finds the driver's socket; also the plugin directory on the host. */}}
{{- define "csi-pmem.pluginDir" -}}
{{- printf "%s/plugins/%s" (trimSuffix "/" .Values.kubeletDir) .Values.driverName -}}
{{- end -}}

{{- define "csi-pmem.emulatedRoot" -}}
{{- default (printf "%s/emulated" (trimSuffix "/" .Values.stateDir)) .Values.backend.emulated.root -}}
{{- end -}}

{{/* backend.emulated.regions as the driver's NUMA=SIZE list: "0=2Gi,1=2Gi". */}}
{{- define "csi-pmem.emulatedRegions" -}}
{{- $parts := list -}}
{{- range .Values.backend.emulated.regions -}}
{{- $parts = append $parts (printf "%d=%s" (int .numaNode) (toString .size)) -}}
{{- end -}}
{{- join "," $parts -}}
{{- end -}}

{{/* The GPU copy service's image: the driver's (tag included) unless it names its own. */}}
{{- define "csi-pmem.gpuCopyImage" -}}
{{- if .Values.gpuCopy.image.repository -}}
{{- include "csi-pmem.image" (list .Values.gpuCopy.image .) -}}
{{- else -}}
{{- include "csi-pmem.image" (list .Values.driver.image .) -}}
{{- end -}}
{{- end -}}

{{/*
The memory back end (backend.type memory). Its pools are the node's DRAM, so the driver
container asks the scheduler for them (README.md, "Memory the scheduler sees"): the
chart sums backend.memory.pools itself, never a second value to keep in step. A share
of a node's memory (50%) cannot be summed here (the chart does not know the nodes), so
such a pool needs backend.memory.poolsTotal, and only such a pool may have one.
*/}}

{{- define "csi-pmem.memoryRoot" -}}
{{- default (printf "%s/memory" (trimSuffix "/" .Values.stateDir)) .Values.backend.memory.root | trimSuffix "/" -}}
{{- end -}}

{{/* backend.memory.pools as the driver's NUMA=SIZE list: "0=64Gi,1=50%". */}}
{{- define "csi-pmem.memoryPools" -}}
{{- $parts := list -}}
{{- $seen := dict -}}
{{- range .Values.backend.memory.pools -}}
{{- $node := toString (int .numaNode) -}}
{{- if hasKey $seen $node -}}
{{- fail (printf "backend.memory.pools: NUMA node %s has two pools (%s and %s); give each node one pool, of the two sizes' sum" $node (get $seen $node) (toString .size)) -}}
{{- end -}}
{{- $_ := set $seen $node (toString .size) -}}
{{- $parts = append $parts (printf "%d=%s" (int .numaNode) (toString .size)) -}}
{{- end -}}
{{- join "," $parts -}}
{{- end -}}

{{/*
A quantity as bytes: (list QUANTITY WHAT). A whole number of bytes, Ki, Mi, Gi or Ti
(1073741824, 512Mi, 64Gi); anything else fails the render naming WHAT.
*/}}
{{- define "csi-pmem.bytes" -}}
{{- $q := index . 0 -}}
{{- if not (kindIs "string" $q) -}}{{- $q = toString (int64 $q) -}}{{- end -}}
{{- if not (regexMatch "^[0-9]+(Ki|Mi|Gi|Ti)?$" $q) -}}
{{- fail (printf "%s: %q is not a size in bytes, Ki, Mi, Gi or Ti (for example 64Gi)" (index . 1) $q) -}}
{{- end -}}
{{- $unit := dict "" 1 "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 -}}
{{- mul (atoi (regexReplaceAll "[KMGT]i$" $q "")) (get $unit (regexReplaceAll "^[0-9]+" $q "")) -}}
{{- end -}}

{{/* Bytes as a Kubernetes quantity: Gi when whole gibibytes, else Mi, Ki or bytes. */}}
{{- define "csi-pmem.quantity" -}}
{{- $b := int64 . -}}
{{- if and (gt $b 0) (eq (mod $b 1073741824) 0) -}}{{ div $b 1073741824 }}Gi
{{- else if eq (mod $b 1048576) 0 -}}{{ div $b 1048576 }}Mi
{{- else if eq (mod $b 1024) 0 -}}{{ div $b 1024 }}Ki
{{- else -}}{{ $b }}{{- end -}}
{{- end -}}

{{/*
What the memory pools of a node add up to, in bytes, as the driver sizes them: each
pool rounded down to 16Mi (a hugetlbfs pool of 1G pages must be whole GiB). With a pool
given as a share of its node: backend.memory.poolsTotal, or a failed render.
*/}}
{{- define "csi-pmem.memoryPoolsBytes" -}}
{{- $m := .Values.backend.memory -}}
{{- $shares := list -}}
{{- $sum := 0 -}}
{{- range $m.pools -}}
{{- $size := toString .size -}}
{{- if hasSuffix "%" $size -}}
{{- $shares = append $shares (printf "%d=%s" (int .numaNode) $size) -}}
{{- else -}}
{{- $what := printf "backend.memory.pools: NUMA node %d" (int .numaNode) -}}
{{- $b := include "csi-pmem.bytes" (list $size $what) | atoi -}}
{{- $b = mul (div $b 16777216) 16777216 -}}
{{- if eq $b 0 -}}
{{- fail (printf "%s: a pool of %s is smaller than 16Mi" $what $size) -}}
{{- end -}}
{{- if and (eq $m.fs "hugetlbfs") (eq $m.pages "1G") (ne (mod $b 1073741824) 0) -}}
{{- fail (printf "%s: a pool of %s is not a whole number of 1G huge pages (backend.memory.pages 1G): give whole Gi" $what $size) -}}
{{- end -}}
{{- $sum = add $sum $b -}}
{{- end -}}
{{- end -}}
{{- if $shares -}}
{{- if not $m.poolsTotal -}}
{{- fail (printf "backend.memory.pools: %s is a share of a NUMA node's memory, which the chart cannot know, so it cannot request the pools' memory for the driver (the scheduler would not see it): give each pool as a size (for example 64Gi), or set backend.memory.poolsTotal to what the pools add up to on these nodes" (join "," $shares)) -}}
{{- end -}}
{{- $total := include "csi-pmem.bytes" (list $m.poolsTotal "backend.memory.poolsTotal") | atoi -}}
{{- $page := get (dict "2M" 2097152 "1G" 1073741824) $m.pages -}}
{{- if and (eq $m.fs "hugetlbfs") (ne (mod $total $page) 0) -}}
{{- fail (printf "backend.memory.poolsTotal: %s is not a whole number of %s huge pages (backend.memory.pages)" (toString $m.poolsTotal) $m.pages) -}}
{{- end -}}
{{- $total -}}
{{- else -}}
{{- if $m.poolsTotal -}}
{{- fail (printf "backend.memory.poolsTotal: set to %s, but every pool has a size, and the chart requests their sum itself (%s); remove poolsTotal (it is only for pools given as a share, e.g. 50%%)" (toString $m.poolsTotal) (include "csi-pmem.quantity" $sum)) -}}
{{- end -}}
{{- $sum -}}
{{- end -}}
{{- end -}}

{{/*
The driver container's resources: driver.resources, and with the memory back end the
pools on top. hugetlbfs pools: hugepages-2Mi or hugepages-1Gi, requests and limits,
equal to the pools (kubelet sets the pod's hugetlb limit to exactly that, 0 without
it); tmpfs pools: the memory request (and a memory limit, if one is set) raised by the
pools, whose pages the driver's fallocate charges to its memory cgroup.
*/}}
{{- define "csi-pmem.driverResources" -}}
{{- $res := deepCopy (.Values.driver.resources | default dict) -}}
{{- if eq .Values.backend.type "memory" -}}
{{- $m := .Values.backend.memory -}}
{{- $pools := include "csi-pmem.memoryPoolsBytes" . | atoi -}}
{{- $req := get $res "requests" | default dict -}}
{{- $lim := get $res "limits" | default dict -}}
{{- if eq $m.fs "hugetlbfs" -}}
{{- $key := printf "hugepages-%si" $m.pages -}}
{{- if or (hasKey $req $key) (hasKey $lim $key) -}}
{{- fail (printf "driver.resources: %s is the sum of backend.memory.pools, set by the chart; remove it from driver.resources" $key) -}}
{{- end -}}
{{- if not (or (hasKey $req "memory") (hasKey $req "cpu")) -}}
{{- fail (printf "driver.resources: the driver requests %s for its hugetlbfs pools, and Kubernetes refuses a container that requests huge pages without a cpu or memory request; set driver.resources.requests.memory (for example 128Mi)" $key) -}}
{{- end -}}
{{- $_ := set $req $key (include "csi-pmem.quantity" $pools) -}}
{{- $_ = set $lim $key (include "csi-pmem.quantity" $pools) -}}
{{- else -}}
{{- $own := 0 -}}
{{- with $req.memory -}}
{{- $own = include "csi-pmem.bytes" (list . "driver.resources.requests.memory") | atoi -}}
{{- end -}}
{{- $_ := set $req "memory" (include "csi-pmem.quantity" (add $own $pools)) -}}
{{- with $lim.memory -}}
{{- $limit := include "csi-pmem.bytes" (list . "driver.resources.limits.memory") | atoi -}}
{{- $_ = set $lim "memory" (include "csi-pmem.quantity" (add $limit $pools)) -}}
{{- end -}}
{{- end -}}
{{- $_ := set $res "requests" $req -}}
{{- if $lim -}}{{- $_ = set $res "limits" $lim -}}{{- end -}}
{{- end -}}
{{- if $res -}}{{- toYaml $res -}}{{- end -}}
{{- end -}}
