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
